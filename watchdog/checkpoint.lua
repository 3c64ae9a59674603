-- Save one partition's checkpoint, fenced and idempotent. Loaded by watchdog/checkpoint.py.
--
-- KEYS[1] owner key (the partition's ownership token)   KEYS[2] checkpoint hash
-- KEYS[3] windows stream   KEYS[4] outbox stream   KEYS[5..] engine-state keys (one per route)
-- ARGV[1] our token  ARGV[2] sequence number  ARGV[3] checkpoint JSON  ARGV[4] windows MAXLEN
-- ARGV[5] number of window records W  ARGV[6] number of outbox records B
-- ARGV[7 .. 6+W] window records (JSON)  ARGV[7+W .. 6+W+B] outbox records (JSON)
-- ARGV[7+W+B ..] engine-state JSON, one per KEYS[5..]
--
-- Returns {status, detail}: saved | duplicate (this sequence number, or a later one, is stored
-- already: a retried save whose first attempt landed) | fenced (another owner holds the partition).

local owner = redis.call('GET', KEYS[1])
if not owner then
  -- Redis lost the key (restart without persistence, failover): nobody claimed the partition since
  -- (a claim sets it), so the writer keeps it
  redis.call('SET', KEYS[1], ARGV[1])
elseif owner ~= ARGV[1] then
  return {'fenced', owner}
end
local cur = tonumber(redis.call('HGET', KEYS[2], 'seq') or '0')
local seq = tonumber(ARGV[2])
if cur >= seq then
  return {'duplicate', tostring(cur)}
end
redis.call('HSET', KEYS[2], 'seq', ARGV[2], 'json', ARGV[3])
local nw, nb = tonumber(ARGV[5]), tonumber(ARGV[6])
for i = 1, nw do
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'json', ARGV[6 + i])
end
for i = 1, nb do
  redis.call('XADD', KEYS[4], '*', 'json', ARGV[6 + nw + i])
end
for i = 5, #KEYS do
  redis.call('SET', KEYS[i], ARGV[6 + nw + nb + i - 4])
end
return {'saved', ARGV[2]}
