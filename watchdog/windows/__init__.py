"""Stage 2, events to signals: per-route tumbling windows on event time with latency sketches and
FP8-vs-FP16 shadow agreement (``aggregator``, ``window``, ``sketch``, ``shadow``). A closed window
becomes one ``Signal`` per (model, route, precision).
"""
