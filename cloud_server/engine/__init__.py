"""The engines that run the target's forwards, behind one interface (interface.py)."""
