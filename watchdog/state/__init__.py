"""What survives a restart, in Redis: partition checkpoints written atomically with their Lua scripts
(``checkpoint``, ``checkpoint.lua``, ``claim.lua``), the per-partition state they carry
(``partitions``), the singleton lease (``lease``) and Redis connections including Sentinel
(``redis_conn``).
"""
