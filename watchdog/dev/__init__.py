"""Development and demo tooling, never imported by the daemon: the demo (``demo``, ``demo_golden``,
``gateway_demo``), a traffic generator (``traffic``), an alert sink (``alertsink``) and embedded
Redis/Tansu services (``embedded``).
"""
