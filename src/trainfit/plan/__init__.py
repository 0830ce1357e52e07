"""`trainfit plan`: space.py lists each choice's options, search.py finds and ranks the layouts
that fit, explain.py says what each gives up and writes the winner as a config, fixes.py finds the
fewest changes that make a config fit (`trainfit estimate`). Torch-free."""
