from services._main import run_stage
from services.gateway.server import serve

run_stage("gateway", serve)
