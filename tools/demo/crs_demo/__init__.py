"""The crs-consumer demo: a synthetic region, Nova outcomes over it, and the `make demo` tour.

A tool for development clusters (the dev stack, docker-compose), kept out of the service's
package and its runtime image. It reuses the service's Kubernetes client and resource
kinds, and only ever replaces or deletes objects it labelled as its own.
"""
