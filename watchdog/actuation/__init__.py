"""Stage 4, decisions to flags: the actuator that writes a flip, its audit record, its engine state and
its page in one fenced Lua script (``actuator``, ``flip.lua``), the pager that sends pages from the
outbox (``outbox``), and the flag reader gateways use (``routing``).
"""
