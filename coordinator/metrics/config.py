"""Settings of the Prometheus endpoint each Sparrow process exposes."""

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_ALPHA_BUCKETS = [0.5, 0.6, 0.7, 0.75, 0.8, 0.83, 0.85, 0.86, 0.87, 0.88, 0.9, 0.92, 0.94, 0.96, 0.98, 0.99, 1.0]


class MetricsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="serve /metrics from this process")
    host: str = Field("127.0.0.1", description="bind address (0.0.0.0 to let a Prometheus on another host scrape)")
    port: int = Field(9400, ge=0, le=65535, description="the coordinator's port (the first tried); rollout workers and "
                      "trainer ranks try from port + 1 upwards; 0 picks any free port everywhere")
    port_search: int = Field(16, ge=1, le=1024, description="ports the coordinator tries upwards from `port` when it is "
                             "taken (workers and ranks try at least 256)")
    file_sd_dir: str | None = Field(
        None, description="besides RUN_DIR/prometheus_targets.json, also write the run's scrape targets to "
        "<file_sd_dir>/<run name>.json, so one Prometheus (file_sd_configs: <file_sd_dir>/*.json) follows every run",
    )
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

    def for_role(self, role: str) -> "MetricsConfig":
        """The settings a process of `role` binds with: the coordinator from `port`, every other process
        (rollout workers, trainer ranks: several may share a node) from `port + 1` upwards."""
        if role == "coordinator" or self.port == 0:
            return self
        return self.model_copy(update={"port": self.port + 1, "port_search": max(self.port_search, 256)})
