"""python -m grace: versions, native libraries and which methods run natively (grace.info)."""
from grace.about import info

info()
