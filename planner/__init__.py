"""The SLO autoscaler: how many prefill and decode workers the load needs (policy.py, plain
Python), and a discrete-event model of a cluster to try it on a day of load (simulator.py)."""
