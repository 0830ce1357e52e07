"""`trainfit validate`: the estimators checked against measured steps on one device. grid.py says
what runs (torch-free), worker.py runs one point, run.py drives them all, machine.py names the
machine and the code, table.py prints."""
