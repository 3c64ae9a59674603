"""The daemon's configuration: typed settings validated at load with ``file:line:col`` positions
(``settings``), the YAML position tracker shared with the policy loader (``yamlpos``). Every YAML
file the project reads goes through ``watchdog.core.safe_yaml``.
"""
