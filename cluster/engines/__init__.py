"""What the gateway knows about its engines, beside the data plane.

health.py   liveness model: an engine is alive, slow or dead
"""
