"""What the gateway knows about its engines, beside the data plane.

health.py       liveness model: an engine is alive, slow or dead
death_watch.py  fast DEAD verdicts: a dropped connection confirmed by the pid
"""
