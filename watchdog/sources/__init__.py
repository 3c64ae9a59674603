"""Signal sources other than Kafka: scheduled and on-suspicion golden replays (``golden``) and GPU
health through NVML (``gpu``). They adapt ``probes/`` to the daemon: each turns a measurement into
``Signal`` objects.
"""
