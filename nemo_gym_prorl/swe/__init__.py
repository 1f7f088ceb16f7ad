"""The offline SWE suite: procedural bugs in pinned PyPI projects (`prorl swe generate`)."""
