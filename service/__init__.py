"""crs-consumer: committed-resource slot recorder for the Cortex Nova scheduler."""
