"""PostgreSQL adapters (asyncpg)."""
