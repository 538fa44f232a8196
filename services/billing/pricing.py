"""Token price table: converts one model call's token counts into millicredits.

The table lives in a TOML file (`services/billing/prices.toml` by default,
LOOPLINE_BILLING_PRICES_PATH) with prices in millicredits per 1,000 tokens
(1 run credit = 1,000 millicredits). Source of the rule: DESIGN.md "Billing" (token
usage converted to credits by a price table; bring-your-own-key usage not credited).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

from services.common.config import read_toml_file


@dataclass(frozen=True)
class Price:
    """Millicredits per 1,000 tokens for each token kind (non-negative integers)."""

    input: int
    output: int
    cache_read: int
    cache_write: int

    @classmethod
    def parse(cls, row: dict[str, object], where: str) -> Price:
        """A Price from a TOML table; raises ValueError when `row` is not a table or a field is
        not a non-negative integer (a missing field is 0)."""
        if not isinstance(row, dict):
            raise ValueError(f"price {where} must be a table")
        values: dict[str, int] = {}
        for name in ("input", "output", "cache_read", "cache_write"):
            value = row.get(name, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"price {where}.{name} must be a non-negative integer")
            values[name] = value
        return cls(**values)


@dataclass(frozen=True)
class PriceTable:
    """Prices per (provider, model), with per-provider "*" rows and a default row."""

    default: Price
    models: dict[tuple[str, str], Price]

    @classmethod
    def load(cls, path: pathlib.Path) -> PriceTable:
        """Read the TOML price table at `path` (LOOPLINE_BILLING_PRICES_PATH).

        Raises ValueError naming the file: it cannot be read or is not TOML
        (`read_toml_file`), it has no [default] row, a row is not a table, or a price field is
        not a non-negative integer (`Price.parse`).
        """
        data = read_toml_file(path, "price table", "LOOPLINE_BILLING_PRICES_PATH")
        try:
            if "default" not in data:
                raise ValueError("has no [default] row")
            providers = data.get("models", {})
            if not isinstance(providers, dict) or not all(
                isinstance(rows, dict) for rows in providers.values()
            ):
                raise ValueError("`models` must be tables of [models.<provider>.<model>] rows")
            models: dict[tuple[str, str], Price] = {}
            for provider, rows in providers.items():
                for model, row in rows.items():
                    models[(provider, model)] = Price.parse(row, f"models.{provider}.{model}")
            return cls(default=Price.parse(data["default"], "default"), models=models)
        except ValueError as exc:
            raise ValueError(f"price table {path}: {exc}") from None

    def price(self, provider_id: str, model_id: str) -> Price:
        """The price of a model: exact row, else the provider's "*" row, else the default."""
        return (
            self.models.get((provider_id, model_id))
            or self.models.get((provider_id, "*"))
            or self.default
        )

    def millicredits(
        self,
        provider_id: str,
        model_id: str,
        *,
        input_tokens: int,
        output_tokens: int,
        cache_read_tokens: int = 0,
        cache_write_tokens: int = 0,
        byok: bool = False,
    ) -> int:
        """Millicredits of one call, rounded up to a whole millicredit; 0 when `byok`.

        `input_tokens` must count uncached input only (cache reads and writes are priced
        by their own rows), so a token is never priced twice.
        """
        if byok:
            return 0
        p = self.price(provider_id, model_id)
        total = (
            input_tokens * p.input
            + output_tokens * p.output
            + cache_read_tokens * p.cache_read
            + cache_write_tokens * p.cache_write
        )
        return -(-total // 1000)
