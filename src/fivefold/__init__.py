"""fivefold: train transformer LMs with the five parallelisms and account for every byte sent."""
__version__ = "0.1.0"
