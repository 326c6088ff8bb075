# One image with the three services, reviewlane-admin (provisioning, health probes) and
# the simulated provider; the command picks which.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bins \
      -p reviewlane-ingress -p reviewlane-extractor -p reviewlane-publisher -p reviewlane-shared \
    && cargo build --release --locked -p loadtest --bin reviewlane-sim

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home reviewlane \
    # File sinks: a volume mounted here starts owned by the service user.
    && mkdir -p /var/lib/reviewlane && chown 10001:10001 /var/lib/reviewlane
COPY --from=build /src/target/release/reviewlane-ingress /src/target/release/reviewlane-extractor \
     /src/target/release/reviewlane-publisher /src/target/release/reviewlane-admin \
     /src/target/release/reviewlane-sim /usr/local/bin/
USER 10001
ENV REVIEWLANE_LOG_FORMAT=json
