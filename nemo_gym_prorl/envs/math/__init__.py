"""The ``math`` task type: a boxed or final answer graded with math-verify."""
