"""`trainfit calibrate`: measure this machine into a hardware profile (hardware_profile.py) that
the time model (perf/) reads.

machine.py runs the measurements and builds the profile; comms.py times collectives in spawned
processes and fits them; probe.py holds the timing loops; host.py builds and parallelizes a tiny
model (train/parallelize.py) to time DTensor's and FSDP2's host work; settings.py says what each
device type measures. It sits above train/, which it uses; nothing below imports it.
"""
