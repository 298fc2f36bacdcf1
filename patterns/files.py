"""Where the built-in .fpat files live: this package's folder, in a source checkout and installed alike.

One definition for every reader: the registry loads them from here, the loader marks declarations from them
as built-ins, and the matcher shows their locations as `patterns/NAME.fpat` wherever the package lives.
"""
from pathlib import Path

BUILTIN_DIR = Path(__file__).resolve().parent
