// Includes every public header from C++ so the headers stay clean (extern "C",
// no C-only constructs). Add each new public header here.
#include "moetax/status.h"
#include "moetax/types.h"
#include "moetax/gguf.h"
#include "moetax/kernels.h"
#include "moetax/pool.h"
#include "moetax/membw.h"
#include "moetax/gen.h"
#include "moetax/tokenizer.h"
#include "moetax/sampler.h"
#include "moetax/report.h"
#include "moetax/store.h"
#include "moetax/predict.h"
#include "moetax/outfile.h"
#include "moetax/readfile.h"

int main() { return moetax_status_name(MOETAX_OK)[0] == 'M' ? 0 : 1; }
