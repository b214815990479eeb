/*
 * A fake CUDA device for tracing, loaded with LD_PRELOAD in front of the real libcudart.
 *
 * memexp traces a training step of a CUDA build of torch under FakeTensorMode: every tensor is
 * metadata, no kernel runs, no device memory is allocated. torch still asks the CUDA runtime
 * about the device before it picks its CUDA code paths (autocast, GradScaler, the SDPA kernel,
 * cuDNN batch norm, fused optimizers). This library answers those questions as one device
 * whose description comes from MEMEXP_FAKECUDA_* variables (memexp.fakecuda sets them from its
 * GPU table). The list was read off torch 2.14.1+cu130 with gdb, a breakpoint on each of
 * libcudart.so.13's ~420 exported functions, while memexp traced transformer and ResNet steps
 * (amp, bf16, checkpointing, offload, fused AdamW). Those traces call cudaGetDevice,
 * cudaSetDevice, cudaGetDeviceCount, cudaGetDeviceProperties, cudaStreamIsCapturing,
 * cudaDeviceGetStreamPriorityRange and cudaGetDriverEntryPointByVersion, and of the real
 * runtime only __cudaUnregisterFatBinary at exit; the other answers cover torch paths seen in
 * the first probe of this design (attributes, versions, error state, capture info) and
 * torch.cuda.mem_get_info. A rank of parallel=fsdp, traced on a fake process group, also
 * creates streams and records and waits on events (fully_shard's gathers and reductions); one
 * of parallel=ddp|zero1 also reads the time between two events (DDP's logger).
 *
 * It never pretends to do work: the calls that would allocate device or pinned memory, copy,
 * or launch a kernel abort the process with a message naming the call. Under FakeTensorMode
 * none of them happens, so a trace that finishes is a trace in which nothing ran.
 *
 * The symbols are unversioned, so they also satisfy torch's versioned references
 * (cudaGetDevice@libcudart.so.13): the dynamic linker takes the first object in load order,
 * and LD_PRELOAD puts this one first. Built by memexp.fakecuda.build() with gcc, no CUDA
 * headers needed: the few types used are declared here.
 */
#include <dlfcn.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int cudaError_t; /* an enum in the real headers; the ABI is an int */
enum {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidDevice = 101
};

/*
 * struct cudaDeviceProp as CUDA 13 lays it out (driver_types.h). Only the fields a caller may
 * read are named; runs of fields nothing here sets are kept as byte-compatible arrays. The
 * offsets are checked against the real header by tests/test_cuda_trace.py where it is present.
 */
struct cudaDeviceProp {
    char name[256];
    unsigned char uuid[16];
    char luid[8];
    unsigned int luidDeviceNodeMask;
    size_t totalGlobalMem;
    size_t sharedMemPerBlock;
    int regsPerBlock;
    int warpSize;
    size_t memPitch;
    int maxThreadsPerBlock;
    int maxThreadsDim[3];
    int maxGridSize[3];
    size_t totalConstMem;
    int major;
    int minor;
    size_t textureAlignment;
    size_t texturePitchAlignment;
    int multiProcessorCount;
    int integrated;
    int canMapHostMemory;
    int textureAndSurfaceLimits[39]; /* maxTexture1D .. maxSurfaceCubemapLayered[2] */
    size_t surfaceAlignment;
    int concurrentKernels;
    int ECCEnabled;
    int pciBusID;
    int pciDeviceID;
    int pciDomainID;
    int tccDriver;
    int asyncEngineCount;
    int unifiedAddressing;
    int memoryBusWidth;
    int l2CacheSize;
    int persistingL2CacheMaxSize;
    int maxThreadsPerMultiProcessor;
    int streamPrioritiesSupported;
    int globalL1CacheSupported;
    int localL1CacheSupported;
    size_t sharedMemPerMultiprocessor;
    int regsPerMultiprocessor;
    int managedMemory;
    int isMultiGpuBoard;
    int multiGpuBoardGroupID;
    int hostNativeAtomicSupported;
    int pageableMemoryAccess;
    int concurrentManagedAccess;
    int computePreemptionSupported;
    int canUseHostPointerForRegisteredMem;
    int cooperativeLaunch;
    size_t sharedMemPerBlockOptin;
    int pageableMemoryAccessUsesHostPageTables;
    int directManagedMemAccessFromHost;
    int maxBlocksPerMultiProcessor;
    int accessPolicyMaxWindowSize;
    size_t reservedSharedMemPerBlock;
    int laterFields[20]; /* hostRegisterSupported .. hostNumaMultinodeIpcSupported */
    int reserved[56];
};

/* The device, read once from the environment. */
static struct {
    int ready;
    char name[256];
    int major, minor, sms, l2, threads_per_sm, bus_width, driver;
    size_t memory, smem_optin, smem_per_sm;
} dev;

/* How often each answered call was made; written to MEMEXP_FAKECUDA_LOG at exit. */
enum { N_CALLS = 32 };
static const char *call_names[N_CALLS];
static atomic_long call_counts[N_CALLS];

static void count(int slot, const char *name) {
    call_names[slot] = name;
    atomic_fetch_add(&call_counts[slot], 1);
}

__attribute__((noreturn)) static void refuse(const char *call) {
    fprintf(stderr,
            "memexp fakecuda: %s was called. The fake device answers questions about itself;\n"
            "it cannot allocate device memory, copy, or run kernels. Something ran outside\n"
            "FakeTensorMode (a real CUDA tensor or a real kernel launch): the trace is not fake.\n",
            call);
    fflush(stderr);
    abort();
}

static long env_number(const char *key) {
    const char *value = getenv(key);
    char *end;
    if (value == NULL || *value == '\0') {
        fprintf(stderr, "memexp fakecuda: %s is not set (memexp.fakecuda sets it)\n", key);
        abort();
    }
    long number = strtol(value, &end, 10);
    if (*end != '\0') {
        fprintf(stderr, "memexp fakecuda: %s=%s is not a number\n", key, value);
        abort();
    }
    return number;
}

static void load_device(void) {
    if (dev.ready)
        return;
    const char *name = getenv("MEMEXP_FAKECUDA_NAME");
    snprintf(dev.name, sizeof dev.name, "%s", name ? name : "");
    dev.major = (int)env_number("MEMEXP_FAKECUDA_MAJOR");
    dev.minor = (int)env_number("MEMEXP_FAKECUDA_MINOR");
    dev.memory = (size_t)env_number("MEMEXP_FAKECUDA_MEMORY");
    dev.sms = (int)env_number("MEMEXP_FAKECUDA_SMS");
    dev.l2 = (int)env_number("MEMEXP_FAKECUDA_L2");
    dev.smem_optin = (size_t)env_number("MEMEXP_FAKECUDA_SMEM_OPTIN");
    dev.smem_per_sm = (size_t)env_number("MEMEXP_FAKECUDA_SMEM_PER_SM");
    dev.threads_per_sm = (int)env_number("MEMEXP_FAKECUDA_THREADS_PER_SM");
    dev.bus_width = (int)env_number("MEMEXP_FAKECUDA_BUS_WIDTH");
    dev.driver = (int)env_number("MEMEXP_FAKECUDA_DRIVER");
    dev.ready = 1;
}

__attribute__((destructor)) static void write_log(void) {
    const char *path = getenv("MEMEXP_FAKECUDA_LOG");
    if (path == NULL || *path == '\0')
        return;
    FILE *log = fopen(path, "a");
    if (log == NULL)
        return;
    for (int slot = 0; slot < N_CALLS; slot++)
        if (call_names[slot] != NULL)
            fprintf(log, "%s %ld\n", call_names[slot], atomic_load(&call_counts[slot]));
    fclose(log);
}

/* -- the questions torch asks, answered as one device ---------------------------------------- */

cudaError_t cudaGetDeviceCount(int *count_out) {
    count(0, "cudaGetDeviceCount");
    load_device();
    *count_out = 1;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device) {
    count(1, "cudaGetDevice");
    *device = 0;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
    count(2, "cudaSetDevice");
    return device == 0 ? cudaSuccess : cudaErrorInvalidDevice;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device) {
    count(3, "cudaGetDeviceProperties");
    if (device != 0)
        return cudaErrorInvalidDevice;
    load_device();
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "%s", dev.name);
    prop->totalGlobalMem = dev.memory;
    prop->sharedMemPerBlock = 48 * 1024; /* every architecture since Kepler */
    prop->regsPerBlock = 65536;
    prop->warpSize = 32;
    prop->maxThreadsPerBlock = 1024;
    prop->maxThreadsDim[0] = prop->maxThreadsDim[1] = 1024;
    prop->maxThreadsDim[2] = 64;
    prop->maxGridSize[0] = 2147483647;
    prop->maxGridSize[1] = prop->maxGridSize[2] = 65535;
    prop->totalConstMem = 65536;
    prop->major = dev.major;
    prop->minor = dev.minor;
    prop->multiProcessorCount = dev.sms;
    prop->concurrentKernels = 1;
    prop->unifiedAddressing = 1;
    prop->memoryBusWidth = dev.bus_width;
    prop->l2CacheSize = dev.l2;
    prop->maxThreadsPerMultiProcessor = dev.threads_per_sm;
    prop->streamPrioritiesSupported = 1;
    prop->sharedMemPerMultiprocessor = dev.smem_per_sm;
    prop->regsPerMultiprocessor = 65536;
    prop->managedMemory = 1;
    prop->cooperativeLaunch = 1;
    prop->sharedMemPerBlockOptin = dev.smem_optin;
    prop->maxBlocksPerMultiProcessor = 32;
    return cudaSuccess;
}

/* cudaDeviceAttr values (driver_types.h) for the attributes answered. */
enum {
    MaxThreadsPerBlock = 1, MaxSharedMemoryPerBlock = 8, WarpSize = 10,
    MultiProcessorCount = 16, L2CacheSize = 38, MaxThreadsPerMultiProcessor = 39,
    ComputeCapabilityMajor = 75, ComputeCapabilityMinor = 76,
    MaxSharedMemoryPerMultiprocessor = 81, MaxRegistersPerMultiprocessor = 82,
    MaxSharedMemoryPerBlockOptin = 97, MemoryPoolsSupported = 115,
};

cudaError_t cudaDeviceGetAttribute(int *value, int attribute, int device) {
    count(4, "cudaDeviceGetAttribute");
    if (device != 0)
        return cudaErrorInvalidDevice;
    load_device();
    switch (attribute) {
    case MaxThreadsPerBlock: *value = 1024; break;
    case MaxSharedMemoryPerBlock: *value = 48 * 1024; break;
    case WarpSize: *value = 32; break;
    case MultiProcessorCount: *value = dev.sms; break;
    case L2CacheSize: *value = dev.l2; break;
    case MaxThreadsPerMultiProcessor: *value = dev.threads_per_sm; break;
    case ComputeCapabilityMajor: *value = dev.major; break;
    case ComputeCapabilityMinor: *value = dev.minor; break;
    case MaxSharedMemoryPerMultiprocessor: *value = (int)dev.smem_per_sm; break;
    case MaxRegistersPerMultiprocessor: *value = 65536; break;
    case MaxSharedMemoryPerBlockOptin: *value = (int)dev.smem_optin; break;
    case MemoryPoolsSupported: *value = 1; break;
    default:
        /* Not known here: say so rather than let a made-up value steer a kernel choice. */
        fprintf(stderr, "memexp fakecuda: cudaDeviceGetAttribute(%d) is not answered\n",
                attribute);
        return cudaErrorInvalidValue;
    }
    return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int *version) {
    count(5, "cudaDriverGetVersion");
    load_device();
    *version = dev.driver;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest) {
    count(6, "cudaDeviceGetStreamPriorityRange");
    *least = 0; /* what current GPUs report: priorities 0 (low) .. -5 (high) */
    *greatest = -5;
    return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
    count(7, "cudaGetLastError");
    return cudaSuccess;
}

cudaError_t cudaPeekAtLastError(void) {
    count(8, "cudaPeekAtLastError");
    return cudaSuccess;
}

/* Nothing is ever captured into a CUDA graph: status 0 is cudaStreamCaptureStatusNone. */
cudaError_t cudaStreamIsCapturing(void *stream, int *status) {
    (void)stream;
    count(9, "cudaStreamIsCapturing");
    *status = 0;
    return cudaSuccess;
}

cudaError_t cudaStreamGetCaptureInfo(void *stream, int *status, unsigned long long *id,
                                     void **graph, const void **deps, const void **edges,
                                     size_t *n_deps) {
    (void)stream;
    count(10, "cudaStreamGetCaptureInfo");
    *status = 0;
    if (id) *id = 0;
    if (graph) *graph = NULL;
    if (deps) *deps = NULL;
    if (edges) *edges = NULL;
    if (n_deps) *n_deps = 0;
    return cudaSuccess;
}

/* The whole device is free: nothing is ever allocated on it. */
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    count(11, "cudaMemGetInfo");
    load_device();
    *free_bytes = *total_bytes = dev.memory;
    return cudaSuccess;
}

/*
 * Streams and events: what a parallel option's rank orders its collectives with (fully_shard
 * gathers and reduces on streams of its own, and makes the compute stream wait on their
 * events; memexp estimate traces it on a fake process group). A handle is a byte of its own,
 * never read. Nothing is ever queued on the fake device, so every stream and event is complete:
 * a wait or a synchronize returns at once, and that is the true answer.
 */
typedef void *handle_t;

static cudaError_t make_handle(handle_t *made) {
    *made = malloc(1);
    return *made ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaStreamCreateWithPriority(handle_t *stream, unsigned int flags, int priority) {
    (void)flags;
    (void)priority;
    count(13, "cudaStreamCreateWithPriority");
    return make_handle(stream);
}

cudaError_t cudaEventCreateWithFlags(handle_t *event, unsigned int flags) {
    (void)flags;
    count(14, "cudaEventCreateWithFlags");
    return make_handle(event);
}

cudaError_t cudaEventDestroy(handle_t event) {
    count(15, "cudaEventDestroy");
    free(event);
    return cudaSuccess;
}

/* Ordering and completion: their arguments are never read, so they are declared without them. */
#define COMPLETE(slot, call)   \
    cudaError_t call() {       \
        count(slot, #call);    \
        return cudaSuccess;    \
    }

COMPLETE(16, cudaEventRecord)
COMPLETE(17, cudaEventRecordWithFlags)
COMPLETE(18, cudaStreamWaitEvent)
COMPLETE(19, cudaEventQuery)
COMPLETE(20, cudaEventSynchronize)
COMPLETE(21, cudaStreamQuery)
COMPLETE(22, cudaStreamSynchronize)

/* DistributedDataParallel times its first iterations with events (c10d::CudaTimer, read by
 * its Logger): nothing ran between two events on the fake device, so no time passed. */
cudaError_t cudaEventElapsedTime(float *ms, handle_t start, handle_t end) {
    (void)start;
    (void)end;
    count(23, "cudaEventElapsedTime");
    *ms = 0.0f;
    return cudaSuccess;
}

/*
 * torch (c10::cuda::DriverAPI, built on its first CUDA call) looks up driver functions through
 * the runtime. They come from the stand-in libcuda.so.1 (libcuda.c), whose driver calls either
 * answer about the fake device or abort; a function it lacks is reported as not found, as a
 * real runtime reports a function the installed driver does not have.
 */
cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **function,
                                             unsigned int version, unsigned long long flags,
                                             int *status) {
    (void)version;
    (void)flags;
    count(12, "cudaGetDriverEntryPointByVersion");
    void *driver = dlopen("libcuda.so.1", RTLD_LAZY);
    char versioned[128];
    snprintf(versioned, sizeof versioned, "%s_v2", symbol);
    *function = driver ? dlsym(driver, versioned) : NULL;
    if (*function == NULL && driver)
        *function = dlsym(driver, symbol);
    if (status)
        *status = *function ? 0 : 1; /* cudaDriverEntryPointSuccess / SymbolNotFound */
    return cudaSuccess;
}

/* -- what a fake device must never be asked to do --------------------------------------------- */
/* Their arguments are never read, so they are declared without them. */
#define REFUSE(call) \
    cudaError_t call() { refuse(#call); }

REFUSE(cudaMalloc)
REFUSE(cudaMallocAsync)
REFUSE(cudaMallocManaged)
REFUSE(cudaMallocHost)
REFUSE(cudaHostAlloc)
REFUSE(cudaHostRegister)
REFUSE(cudaMemcpy)
REFUSE(cudaMemcpyAsync)
REFUSE(cudaMemcpyPeerAsync)
REFUSE(cudaMemsetAsync)
REFUSE(cudaLaunchKernel)
REFUSE(cudaLaunchKernelExC)
REFUSE(cudaLaunchCooperativeKernel)
REFUSE(cudaGraphLaunch)
