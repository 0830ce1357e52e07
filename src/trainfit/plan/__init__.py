"""`trainfit plan`: search.py enumerates, prunes and ranks the layouts that fit; explain.py says
what each gives up, writes the winner as a config. Torch-free."""
