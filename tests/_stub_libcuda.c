/* A stand-in libcuda.so.1 for tests/ops/test_real_launcher.py: what Triton's NVIDIA driver module (driver.c, the
 * launcher) calls, answered as one H200 would (device 0, sm_90, 132 SMs), with no GPU. Modules and functions are
 * dummy handles; cuLaunchKernelEx launches nothing and records, per launch, one text line: the function handle,
 * grid, block, shared memory, stream, launch attributes, and every kernel parameter's bytes (hex), for the
 * parameter sizes the test registered for that function (psgd_stub_set_params). Built by the test with gcc against
 * the cuda.h Triton ships; read back with ctypes (psgd_stub_log).
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda.h"

#define MAX_FUNCS 4096
#define MAX_PARAMS 128

static struct {
  CUfunction f;
  int n;
  int sizes[MAX_PARAMS];
} registered[MAX_FUNCS];
static int n_registered;
static uintptr_t next_handle = 0x1000;
static long n_launches;
static char *log_buf;
static size_t log_len, log_cap;

static void say(const char *fmt, ...) {
  va_list ap;
  for (;;) {
    size_t room = log_cap - log_len;
    va_start(ap, fmt);
    int n = vsnprintf(log_buf ? log_buf + log_len : NULL, log_buf ? room : 0, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if (log_buf && (size_t)n < room) {
      log_len += (size_t)n;
      return;
    }
    size_t cap = (log_cap + (size_t)n + 1) * 2;
    char *grown = realloc(log_buf, cap);
    if (!grown) return;
    log_buf = grown;
    log_cap = cap;
  }
}

static void hex(const void *p, size_t n) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; ++i) say("%02x", b[i]);
}

/* ---- the test's side ---- */
int psgd_stub_set_params(CUfunction f, int n, const int *sizes) {
  if (n > MAX_PARAMS) return -1;
  int i = 0;
  while (i < n_registered && registered[i].f != f) ++i;
  if (i == n_registered) {
    if (n_registered == MAX_FUNCS) return -1;
    ++n_registered;
  }
  registered[i].f = f;
  registered[i].n = n;
  memcpy(registered[i].sizes, sizes, sizeof(int) * (size_t)n);
  return 0;
}

size_t psgd_stub_log_size(void) { return log_len; }

size_t psgd_stub_log(char *out, size_t cap) { /* copies the log (cap >= psgd_stub_log_size()), clears it */
  size_t n = log_len < cap ? log_len : cap;
  if (n) memcpy(out, log_buf, n);
  log_len = 0;
  return n;
}

long psgd_stub_launches(void) { return n_launches; }

/* ---- the driver API the NVIDIA backend calls ---- */
CUresult cuInit(unsigned int flags) { return CUDA_SUCCESS; }
CUresult cuDriverGetVersion(int *v) { *v = 12080; return CUDA_SUCCESS; }
CUresult cuDeviceGetCount(int *count) { *count = 1; return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice *device, int ordinal) { *device = 0; return CUDA_SUCCESS; }
CUresult cuCtxGetCurrent(CUcontext *pctx) { *pctx = (CUcontext)0x10; return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext ctx) { return CUDA_SUCCESS; }
CUresult cuCtxGetDevice(CUdevice *device) { *device = 0; return CUDA_SUCCESS; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) { *pctx = (CUcontext)0x10; return CUDA_SUCCESS; }
CUresult cuCtxGetLimit(size_t *value, CUlimit limit) { *value = 1 << 20; return CUDA_SUCCESS; }
CUresult cuCtxSetLimit(CUlimit limit, size_t value) { return CUDA_SUCCESS; }
CUresult cuGetErrorString(CUresult error, const char **s) { *s = "psgd stub libcuda"; return CUDA_SUCCESS; }
CUresult cuGetErrorName(CUresult error, const char **s) { *s = "PSGD_STUB"; return CUDA_SUCCESS; }

CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
  switch (attrib) {
  case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *pi = 232448; break;
  case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *pi = 49152; break;
  case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *pi = 132; break;
  case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: *pi = 65536; break;
  case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *pi = 32; break;
  case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = 1024; break;
  case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: *pi = 1980000; break;
  case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: *pi = 2619000; break;
  case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: *pi = 6144; break;
  case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: *pi = 50 << 20; break;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *pi = 9; break;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *pi = 0; break;
  default: *pi = 0;
  }
  return CUDA_SUCCESS;
}

CUresult cuModuleLoadData(CUmodule *module, const void *image) {
  *module = (CUmodule)(next_handle++);
  return CUDA_SUCCESS;
}
CUresult cuModuleUnload(CUmodule hmod) { return CUDA_SUCCESS; }
CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
  *hfunc = (CUfunction)(next_handle++);
  return CUDA_SUCCESS;
}
CUresult cuFuncGetAttribute(int *pi, CUfunction_attribute attrib, CUfunction hfunc) {
  switch (attrib) {
  case CU_FUNC_ATTRIBUTE_NUM_REGS: *pi = 32; break;
  case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = 1024; break;
  default: *pi = 0;
  }
  return CUDA_SUCCESS;
}
CUresult cuFuncSetAttribute(CUfunction hfunc, CUfunction_attribute attrib, int value) { return CUDA_SUCCESS; }
CUresult cuFuncSetCacheConfig(CUfunction hfunc, CUfunc_cache config) { return CUDA_SUCCESS; }

static void pointer_attribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
  switch (attribute) { /* every pointer is device memory of device 0 */
  case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *(CUdeviceptr *)data = ptr; break;
  case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *(unsigned int *)data = CU_MEMORYTYPE_DEVICE; break;
  case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = 0; break;
  case CU_POINTER_ATTRIBUTE_IS_MANAGED: *(unsigned int *)data = 0; break;
  default: break;
  }
}
CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
  pointer_attribute(data, attribute, ptr);
  return CUDA_SUCCESS;
}
CUresult cuPointerGetAttributes(unsigned int n, CUpointer_attribute *attributes, void **data, CUdeviceptr ptr) {
  for (unsigned int i = 0; i < n; ++i) pointer_attribute(data[i], attributes[i], ptr);
  return CUDA_SUCCESS;
}
CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *status) {
  *status = CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}
CUresult cuOccupancyMaxActiveClusters(int *n, CUfunction func, const CUlaunchConfig *config) {
  *n = 1;
  return CUDA_SUCCESS;
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra) {
  ++n_launches;
  say("f=%llx grid=%u,%u,%u block=%u,%u,%u smem=%u stream=%llx attrs=", (unsigned long long)(uintptr_t)f,
      config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX, config->blockDimY, config->blockDimZ,
      config->sharedMemBytes, (unsigned long long)(uintptr_t)config->hStream);
  for (unsigned int i = 0; i < config->numAttrs; ++i) {
    say("%s%d:", i ? "," : "", (int)config->attrs[i].id);
    hex(&config->attrs[i].value, sizeof(config->attrs[i].value));
  }
  say(" extra=%d args=", extra != NULL);
  int i = 0;
  while (i < n_registered && registered[i].f != f) ++i;
  if (i == n_registered) {
    say("unregistered\n");
    return CUDA_SUCCESS;
  }
  for (int k = 0; k < registered[i].n; ++k) {
    if (k) say(",");
    hex(kernelParams[k], (size_t)registered[i].sizes[k]);
  }
  say("\n");
  return CUDA_SUCCESS;
}
