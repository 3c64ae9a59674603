"""The daemon's configuration: typed settings validated at load with ``file:line:col`` positions
(``settings``, which also owns the alert-channel schema), the YAML position tracker shared with the
policy loader (``yamlpos``) and the one redactor of secrets (``redact``). Every YAML file the
project reads goes through ``watchdog.core.safe_yaml``.
"""
