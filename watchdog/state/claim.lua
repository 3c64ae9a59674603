-- Take ownership of one partition and read its checkpoint in one step. Loaded by watchdog/state/checkpoint.py.
-- KEYS[1] owner key  KEYS[2] checkpoint hash  KEYS[3] the owner key's generation counter
-- ARGV[1] instance name (every key is declared: ACL key patterns and Cluster routing see them)
-- Returns {token, field1, value1, ...} (the whole checkpoint hash); the token is
-- "<generation>:<instance>", so a writer that held an older token (a zombie after a rebalance) is
-- refused by checkpoint.lua and flip.lua.
local gen = redis.call('INCR', KEYS[3])
local token = tostring(gen) .. ':' .. ARGV[1]
redis.call('SET', KEYS[1], token)
local out = redis.call('HGETALL', KEYS[2])
table.insert(out, 1, token)
return out
