"""The stream engine's unit tests, one module per engine module, on fake time (conftest.py)
against the in-memory Kafka of tests/fake_kafka.py; the same behaviours run on the real
broker in tests/integration."""
