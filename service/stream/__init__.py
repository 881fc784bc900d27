"""The Kafka side of the service: wire codec, per-record processing, consume-produce loop.

Everything Kafka-specific lives here so the CR domain (:mod:`service.crs`) stays pure.
"""
