"""What every section of the agent's TOML config shares: the strict model base and ``Name``.

Strict types (TOML has real types: ``port = "502"`` is an error, not a guess), unknown keys
rejected (a typo never falls back to a default), frozen (a config is read once).
"""

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

#: Device, site, signal, entry and class names: safe in MQTT topics, file names and logs.
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$")]

#: A time in ms: positive, at most an hour.
PositiveMs = Annotated[int, Field(gt=0, le=3_600_000)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
