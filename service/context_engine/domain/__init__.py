"""The pure core: items, regions, plans, envelopes, the builder and the estimator port.

Imports nothing but the standard library and its own modules (no grpc, asyncpg, prometheus or
opentelemetry); ``build()`` touches no clock, randomness or I/O.
"""
