import os
import sys

# The helpers (otlp_sink, torchrun_job) sit beside the tests; importlib mode does not
# put this folder on sys.path by itself.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
