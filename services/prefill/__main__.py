from services._main import run_stage
from services.prefill.server import serve

run_stage("prefill", serve)
