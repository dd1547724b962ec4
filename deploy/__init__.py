"""Deploy files (Dockerfile, compose, Kubernetes, setup.sh) and the benchmark package `deploy.bench`."""
