/*
 * A stand-in for the CUDA driver library (libcuda.so.1), for machines that have none.
 *
 * torch's NVRTC stub (libcaffe2_nvrtc.so) links libcuda.so.1, and torch asks it a few things
 * at start-up: whether the device has a primary context (autograd's engine asks before it
 * runs backward), and the driver's version. memexp.fakecuda builds this file as libcuda.so.1
 * and puts its folder first on LD_LIBRARY_PATH of the trace process only.
 *
 * The answers describe the same single device as fakecudart.c. Everything else in the NVRTC
 * stub's import list (loading modules, linking, launching, making contexts) aborts with the
 * call's name. cuGetProcAddress aborts too: the real CUDA runtime calls it when it starts
 * talking to a driver, which means some CUDA runtime call got past the fake device.
 */
#include <stdio.h>
#include <stdlib.h>

typedef int CUresult;
enum { CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1, CUDA_ERROR_INVALID_DEVICE = 101 };

__attribute__((noreturn)) static void refuse(const char *call) {
    fprintf(stderr,
            "memexp fakecuda: the driver call %s was made. The stand-in libcuda.so.1 answers\n"
            "questions about the fake device only; nothing may run on it.\n",
            call);
    fflush(stderr);
    abort();
}

static int driver_version(void) {
    const char *value = getenv("MEMEXP_FAKECUDA_DRIVER");
    if (value == NULL) {
        fprintf(stderr, "memexp fakecuda: MEMEXP_FAKECUDA_DRIVER is not set\n");
        abort();
    }
    return atoi(value);
}

CUresult cuInit(unsigned int flags) {
    (void)flags;
    return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int *version) {
    *version = driver_version();
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    *count = 1;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(int *device, int ordinal) {
    if (ordinal != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    *device = 0;
    return CUDA_SUCCESS;
}

/* No context is ever made on the fake device: inactive, default flags. */
CUresult cuDevicePrimaryCtxGetState(int device, unsigned int *flags, int *active) {
    if (device != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    *flags = 0;
    *active = 0;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(void **context) {
    *context = NULL;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char **text) {
    *text = error == CUDA_SUCCESS ? "no error" : "error on the memexp fake CUDA device";
    return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char **text) {
    *text = error == CUDA_SUCCESS ? "CUDA_SUCCESS" : "CUDA_ERROR_MEMEXP_FAKE_DEVICE";
    return CUDA_SUCCESS;
}

/* The real CUDA runtime starts talking to a driver through these: torch.cuda's lazy start-up
 * (torch.cuda.init(), get_device_properties()), or a runtime call fakecudart.c does not answer. */
CUresult cuGetProcAddress() { refuse("cuGetProcAddress (the real CUDA runtime starting up)"); }
CUresult cuGetProcAddress_v2() { refuse("cuGetProcAddress_v2 (the real CUDA runtime starting up)"); }

/* Their arguments are never read, so they are declared without them. */
#define REFUSE(call) \
    CUresult call() { refuse(#call); }

REFUSE(cuDevicePrimaryCtxRetain)
REFUSE(cuCtxSetCurrent)
REFUSE(cuCtxCreate_v2)
REFUSE(cuMemAlloc_v2)
REFUSE(cuMemAllocAsync)
REFUSE(cuMemCreate)
REFUSE(cuModuleLoad)
REFUSE(cuModuleLoadData)
REFUSE(cuModuleLoadDataEx)
REFUSE(cuModuleUnload)
REFUSE(cuModuleGetFunction)
REFUSE(cuLinkCreate_v2)
REFUSE(cuLinkAddData_v2)
REFUSE(cuLinkComplete)
REFUSE(cuLaunchKernel)
REFUSE(cuLaunchCooperativeKernel)
REFUSE(cuFuncGetAttribute)
REFUSE(cuFuncSetAttribute)
REFUSE(cuFuncSetCacheConfig)
REFUSE(cuOccupancyMaxActiveBlocksPerMultiprocessor)
REFUSE(cuPointerGetAttribute)
REFUSE(cuTensorMapEncodeTiled)
REFUSE(cuDeviceGetAttribute)
