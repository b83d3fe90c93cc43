"""What training makes and the course ships under minillm/assets (lessons 09-10): the student's recipe (student.py)
and the learned drafter (small_model.py), with the commands that rebuild them. Never imported by the engine at run
time."""
