"""swarm: run a large language model split over several PCs ("fellows") in a ring."""

__version__ = "0.1.0"
