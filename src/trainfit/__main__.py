"""`python -m trainfit` runs the command-line interface."""

from trainfit.cli import main

raise SystemExit(main())
