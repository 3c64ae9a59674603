"""The process: the daemon that wires the stages and runs one loop (``daemon``), its health and
readiness (``health``) and the HTTP surface (``http``: /metrics, /healthz, /readyz, /status).
"""
