"""Stage 1, Kafka to events: the consumer with its dead-letter producer and offset handling
(``consumer``), the OTLP span codec (``otlp``), event time and watermarks (``eventtime``), bounded
start-up with a named cause (``startup``), and the producer half of the events contract that
gateways and integrations use (``emitter``).
"""
