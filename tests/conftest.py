import os
import sys

# Ranks are started by a forkserver, which must be able to import the test modules.
sys.path.insert(0, os.path.dirname(__file__))
