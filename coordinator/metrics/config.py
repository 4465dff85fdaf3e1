"""Settings of the Prometheus endpoint each Sparrow process exposes."""

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_ALPHA_BUCKETS = [0.5, 0.6, 0.7, 0.75, 0.8, 0.83, 0.85, 0.86, 0.87, 0.88, 0.9, 0.92, 0.94, 0.96, 0.98, 0.99, 1.0]


class MetricsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="serve /metrics from this process")
    host: str = Field("127.0.0.1", description="bind address (0.0.0.0 to let a Prometheus on another host scrape)")
    port: int = Field(9400, ge=0, le=65535, description="first port to try; 0 picks any free port")
    port_search: int = Field(16, ge=1, le=1024, description="ports tried upwards from `port` when it is taken")
    alpha_buckets: list[float] = Field(
        default_factory=lambda: list(DEFAULT_ALPHA_BUCKETS),
        description="upper bounds of the sparrow_alpha histogram buckets (+Inf is added)",
    )
    alpha_quantiles: list[float] = Field(
        default_factory=lambda: [1.0, 5.0, 10.0, 50.0], description="percentiles exported as sparrow_alpha_tail"
    )

    @model_validator(mode="after")
    def _check(self):
        b = self.alpha_buckets
        if not b or any(not 0.0 < x <= 1.0 for x in b) or any(y <= x for x, y in zip(b, b[1:])):
            raise ValueError(f"alpha_buckets={b} must be strictly increasing values in (0, 1], e.g. [0.8, 0.86, 0.9, 1.0]")
        bad = [q for q in self.alpha_quantiles if not 0.0 < q < 100.0]
        if bad:
            raise ValueError(f"alpha_quantiles contains {bad}; give percentiles in (0, 100), e.g. [1, 5, 50]")
        return self
