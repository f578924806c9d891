"""Reference answers to the course's exercises: the same modules and names as ``exercises/``.

Read them after trying; the grader (``tests/test_exercises.py``) checks these by default.
"""
