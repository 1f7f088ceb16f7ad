"""The ``code`` task type: a program graded by running its tests in a fresh sandbox."""
