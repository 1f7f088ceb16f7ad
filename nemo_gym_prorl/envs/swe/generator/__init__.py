"""The offline SWE suite generator: real projects' functions broken, each a task with hidden tests."""
