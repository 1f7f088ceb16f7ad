"""The ``swe`` task type: a repository staged in the sandbox, graded by its tests (swebench's harness)."""
