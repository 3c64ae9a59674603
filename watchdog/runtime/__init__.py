"""The process: the daemon that wires the stages and runs one loop (``daemon``), and its rooms:
partitions owned (``ownership``), closing windows (``closer``), decisions and the one flag view
(``decisions``), checkpoints (``checkpointer``), policy reloads (``policies``), readiness and Redis
health (``health``), counters (``stats``), the /status document (``status``) and the HTTP surface
(``http``: /metrics, /healthz, /readyz, /status).
"""
