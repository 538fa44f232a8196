-- One database per service (deploy/compose.yaml runs this on PostgreSQL's first start).
CREATE DATABASE gateway;
CREATE DATABASE orchestrator;
CREATE DATABASE billing;
CREATE DATABASE tools;
