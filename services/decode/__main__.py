from services._main import run_stage
from services.decode.server import serve

run_stage("decode", serve)
