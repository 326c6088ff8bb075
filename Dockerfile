# One image with the three services and reviewlane-admin; the command picks the service.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bins \
      -p reviewlane-ingress -p reviewlane-extractor -p reviewlane-publisher -p reviewlane-shared

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home reviewlane
COPY --from=build /src/target/release/reviewlane-ingress /src/target/release/reviewlane-extractor \
     /src/target/release/reviewlane-publisher /src/target/release/reviewlane-admin /usr/local/bin/
USER 10001
ENV REVIEWLANE_LOG_FORMAT=json
