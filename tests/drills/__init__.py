"""Fault drills: a black-box harness that runs the daemon of any checkout against real Tansu, Redis
and an alert sink, breaks things the way operations do, and counts exactly what was lost.

``harness`` starts and stops the parts, ``ledger`` compares what was produced with what the daemon
recorded, ``catalog`` holds one function per drill. ``bench/drills.py`` runs them all in full;
``tests/test_drills.py`` runs a short CI subset.
"""
