"""The ``stem`` task type: numbers with units, and multiple choice."""
