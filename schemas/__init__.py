"""The contracts: the user's spec, the compiled plan, and the hardware / model data files."""
